"""kveval: what do I lose if I compress the KV cache this way?"""

__version__ = "0.1.0"
