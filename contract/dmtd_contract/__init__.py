"""dmtd_contract: what the operator and the serving side agree on, torch-free and Ray-free.

* ``metric_names``: the Prometheus names the serving side exports and the operator and dashboard read.
* ``registry``: the Redis variant registry client, its entries and the one weighted router.
* ``variant_schema``: the routing conventions and statuses of a variant (one definition of each literal).
* ``records``: the typed request and block records that cross the Ray hop (gateway <-> replica).
* ``stats``: shared helpers (the percentile).

Both images install it (docker/operator.Dockerfile from contract/pyproject.toml, the serving image as part
of the dmtd-platform distribution). It imports nothing of ours outside itself (import-linter).
"""
