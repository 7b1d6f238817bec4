"""`inferbus drill`: break one part of a running platform under load and report what it cost."""
