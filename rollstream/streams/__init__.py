"""faust-streaming processors: admission and response aggregation. Thin: decode -> call
rollstream.filtering -> write table state back by assignment -> emit events."""
