"""Analyses of a kernel's syntax tree. Each is an object holding its results, keyed by the
kernel's nodes or names; none writes to the tree."""
