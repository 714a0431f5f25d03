"""A user-defined forgeax op, end to end: `softcap` (see docs/extending.md)."""
