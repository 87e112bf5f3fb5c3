"""attnprec: attention precision made explicit, per phase, asserted and audited."""

__version__ = "0.1.0"
