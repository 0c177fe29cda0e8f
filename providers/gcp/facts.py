"""What Google Cloud *is*, as data (no SDK, nothing imported from the provider): read by `elastic.record.billing`."""

from providers.base import BillingTerms

BILLING = BillingTerms(minimum_s=60.0, increment_s=1.0)   # Compute Engine bills per second with a one-minute minimum
