"""Running one model over several processes: pipeline stages that each hold a span of
layers (:mod:`tiergen.parallel.stage`), tensor-parallel shards that each hold a slice of
every layer (:mod:`tiergen.parallel.shard`), the process group that links them
(:mod:`tiergen.parallel.group`), and the schedule that keeps every stage busy
(:mod:`tiergen.parallel.pipeline`)."""
