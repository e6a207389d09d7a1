"""Tools for testing and measuring Transom with real jobs, shared by tests/ and benchmarks/.

- `jobs`: the `transom run` command line, the example GPT's progress lines, waiting with a
  deadline, finding and stopping a job's processes, reaching a job's embedded etcd and counting
  the requests it received.
- `store_proxy`: a TCP proxy in front of etcd that can pass, blackhole or delay a node's
  traffic, to cut one node off from etcd while the others keep their way in.
- `tiers`: the pytest plugin that gives every test one tier (unit, integration, e2e) and keeps
  unit tests from starting processes (docs/testing.md); it imports pytest, the others do not.

Nothing in Transom's own processes imports this package; it starts no job by itself.
"""
