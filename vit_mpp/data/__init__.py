"""The data a run reads: manifests (manifest.py), the training data's sets and mixtures (training_data.py), which
samples two sets share (lineage.py), shard reading (shard_reader.py, tar_scan.py) by URL (urls.py) with deadlines
(deadlines.py) and writing by URL (uploads.py), the stream plan (stream_plan.py), the training stream (stream.py) and
the evaluation's (eval_stream.py), image decoding in the workers (image_decoder.py) or on the device
(device_decode.py), the images the tools prepare (image_prep.py), image formats (image_formats.py) and labels
(labels.py). docs/data_stream.md."""
