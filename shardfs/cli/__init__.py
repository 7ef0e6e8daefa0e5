"""The command line, in the user's own process: `shardfs mount|umount|stats|warm|index|pack|demo`.

Parses arguments and settings, then hands a mount to `shardfs.daemon` (which re-executes itself
as the daemon) or runs a one-shot tool.
"""
