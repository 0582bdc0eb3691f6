"""The shelfsync.v1 wire contract (proto/shelfsync/v1/shelfsync.proto), generated.

`from shelfsync_kit.proto import shelfsync_pb2 as pb`. Regenerate with
`python kits/python/tools/gen_proto.py` after changing the contract.
"""
