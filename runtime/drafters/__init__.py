"""Host-side drafters (proposers): one module per method."""
