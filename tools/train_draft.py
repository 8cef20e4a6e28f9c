#!/usr/bin/env python3
"""Distil a draft for a target checkpoint: the same as `nebula-flow train-draft` (see --help)."""

from nebula_flow.cli import train_draft

if __name__ == "__main__":
    train_draft()
