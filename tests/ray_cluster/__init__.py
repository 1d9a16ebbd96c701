"""Tests on a two-node loopback Ray cluster; a package so that its package-scoped cluster ends with it."""
