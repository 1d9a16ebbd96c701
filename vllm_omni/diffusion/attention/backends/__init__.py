"""Attention backends; each module imports its kernel package only when the backend is used."""
