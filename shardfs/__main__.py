from shardfs.cli import main

main()
