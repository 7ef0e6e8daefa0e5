from shardfs.cli.main import main

main()
