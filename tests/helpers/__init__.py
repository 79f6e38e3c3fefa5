"""Plain helpers the tests share (the fixtures are in tests/conftest.py and tests/<folder>/conftest.py).

    shards.py     shard sets made on the fly: write_shard_set (labels, undecodable samples, a manifest that lies),
                  and the images in them (image_bytes, png_bytes)
    build.py      build-shards: a class-folder tree of JPEGs (make_tree), reading a build back (samples,
                  result_files), one_line_error for an in-process build that must refuse
    models.py     the small ViT the unit tests share (SMALL, SMALL_MODEL) and write_encoder_export
    processes.py  child processes: `python -m` (run_module), `accelerate launch` with two CPU processes (LAUNCH,
                  launch), their environment; a stage run in-process with its exit status and output (in_process)
    runs.py       tiny runs in this process (run_tiny_pretrain, run_tiny_finetune) and what a run leaves
                  (read_metrics: metrics.jsonl)
    servers.py    loopback http servers: serve_directory, and serve_faulty (cuts or stalls chosen responses)
"""
