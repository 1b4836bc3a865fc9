"""MindSpeed MM's formats read and translated into this project's configs (Lightning-free, above ``core`` and ``hf``).

Only this layer names MindSpeed MM's keys and module paths.
"""
