"""The transport of a run over several processes: pipeline stages that each hold a span of
layers (:mod:`tiergen.parallel.stage`), tensor-parallel shards that each hold a slice of
every layer (:mod:`tiergen.parallel.shard`), the process group that links them
(:mod:`tiergen.parallel.group`) and the link's measurement (:mod:`tiergen.parallel.link`).
The schedule that drives the ranks is the engine's (:mod:`tiergen.engine.pipeline`)."""
