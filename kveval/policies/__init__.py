"""Compression policies: the contract (:mod:`.base`), the registry (:mod:`.registry`), the spec parser
(:mod:`.spec`), and one module per policy family member."""
