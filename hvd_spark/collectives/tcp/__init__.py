"""The package's own TCP transport: authenticated wire, rendezvous store, ring, shm."""
