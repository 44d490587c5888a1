"""Put this folder's helper modules (rw_graphs, rw_harness) on sys.path."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
