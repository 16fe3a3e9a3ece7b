"""Run orchestration: the train/validate/benchmark job, run directories, config checks, resolvers, sweeps."""
