"""The bottom layer: everything two Transom processes exchange, defined once.

`keys` (etcd key names), `env` (worker environment variables), `files` (run-directory file
names), `states` (the enums every reader compares with), `names` (id validation and sorting),
`records` (the typed records stored under those keys; their validation in `record_base`).
Nothing here imports another transom package, does I/O or starts anything: every other layer
may import it, it imports none of them.
"""
