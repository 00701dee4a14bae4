"""comm="selective": each rank gets from each peer only the K/V of the packed documents its queries read (one
all-to-all of static slots). schedule.py: the slots and their capacity, varlen.py: the region (packed documents
only), entry.py: its registry entry."""
