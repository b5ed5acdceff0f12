"""Development tools: the benchmarks, the soak and the server launcher they share with the tests; not shipped."""
