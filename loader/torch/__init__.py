"""The torch face: loader.DataLoader, torch's rules for drawing orders, framework integrations."""
