"""Executable specification of reorder: invariants (spec.invariants) and slow reference versions
(spec.reference). Never imports `reorder`."""
