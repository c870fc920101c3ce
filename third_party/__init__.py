"""Adapters to engine internals (``fusedrl.third_party``). Nothing else in fusedrl reaches into them."""
