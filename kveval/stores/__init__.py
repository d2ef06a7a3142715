"""Token stores: how one sequence's K/V are held in one layer (the :class:`~kveval.stores.base.TokenStore` interface and each store)."""
