"""Integrations of loader.DataLoader with training frameworks that rebuild
data loaders (see each module)."""
