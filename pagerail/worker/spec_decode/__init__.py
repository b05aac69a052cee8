"""Speculative decoding on the ranks: proposing draft tokens and keeping the ones the target model agrees with."""
