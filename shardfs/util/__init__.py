"""Small helpers with no shardfs dependencies: byte sizes, progress lines, trio utilities."""
