"""Actuators carry out the autoscaler's plans: run N replicas of a pool, promote and demote workers."""
