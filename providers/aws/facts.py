"""What AWS *is*, as data (no SDK, nothing imported from the provider): read by `elastic.record.billing`."""

from providers.base import BillingTerms

# Linux VMs bill per second with a one-minute minimum; a spot VM EC2 interrupts in its first hour bills
# nothing, one the user stops or terminates bills its seconds (EC2 User Guide, "Billing for interrupted
# Spot Instances").
BILLING = BillingTerms(minimum_s=60.0, increment_s=1.0, interrupted_free_s=3600.0)
