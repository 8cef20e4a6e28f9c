"""Llama-family model runtime: ``config`` (facts from config.json, no torch), ``llama`` (the
module), ``loader`` (checkpoints). Import the submodule you need: importing this package loads
nothing, so the broker can read model facts without loading torch."""
