"""Data parallelism: one engine per GPU. `devices` resolves `--gpus`, `pool` runs one engine
process per device over a shared shard queue on one host, `ray_data` the same over a Ray
cluster. What each engine does with its pages is the verb's (parse, bench): it is handed in."""
