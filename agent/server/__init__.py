"""What every transport shares: who may come in (`auth`, `admission`), the live conversations (`sessions`) and `/metrics` (`metrics`)."""
