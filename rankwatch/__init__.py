"""rankwatch's composition root: CLI, settings and the local stack launcher. Imported by nothing."""

__version__ = "0.1.0"
