"""The torture suite: faults of Transom's own control plane while a real job trains.

torture_suite.py (the campaign and its table; `python -m benchmarks.torture`), job.py (the job
under test, local or behind per-node etcd proxies), scenarios.py (the faults and what each must
cost), kills.py (kills around checkpoints), measure.py (what a trial cost)."""
