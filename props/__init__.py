"""props: a property-based suite that proves the numerics claims tinylm rests on."""
