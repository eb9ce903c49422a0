"""Tests of e2 image: the Dockerfile, builds on a real engine, the CPU base end to end."""
