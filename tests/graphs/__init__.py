"""Graphs the pass produces on a fake process group: expecttest snapshots, AOT and Inductor checks."""
