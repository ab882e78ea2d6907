"""What tenants may spend and what they spent: quotas, usage, token metering."""
