"""Training state: canonical snapshot, checksums and peer-to-peer transfer."""
