"""The data plane of a rank: gRPC streams to peer workers, the inbox they fill, the store."""
