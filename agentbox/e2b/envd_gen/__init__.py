"""Messages and Connect services of E2B's envd, generated from E2B's public `.proto` files.

Regenerate (same plugin versions as the `connectrpc` / `protobuf-py` runtime in use):
`protoc -I spec/envd --py_out=. --connectrpc_out=. process/process.proto filesystem/filesystem.proto`.
"""
