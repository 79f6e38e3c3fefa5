"""The data a run reads: manifests, shard reading with deadlines, the stream plan and the training and evaluation
streams, image decoding. docs/data_stream.md."""
