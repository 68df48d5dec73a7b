"""Decoupled DiLoCo on a virtual clock, in one process: the package's own synchronizer service and
island learners, driven by an event queue (run.py), so that one seed and one plan reproduce a run
exactly. For choosing settings without timing noise: ``python -m recipes.simulate`` runs a
recipe's model (docs/recipes.md#simulating-a-run-settings-without-timing-noise)."""
