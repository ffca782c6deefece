"""What the tests (and the benchmarks) share to run code on several processes: `forked.run_forked`,
the one runner of a function on N forked processes, and `cases.Cases`, the named training runs of
a module computed once per session, batched by world size."""
