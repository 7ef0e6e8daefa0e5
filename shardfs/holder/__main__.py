import sys

from shardfs.holder.holder import main

sys.exit(main(sys.argv[1:]))
