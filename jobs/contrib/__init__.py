"""Optional apps that ship with ``jobs``; each works only where it is in INSTALLED_APPS."""
