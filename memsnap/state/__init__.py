"""What a snapshot is: a training state laid out as bytes and read back into live objects.

``capture`` (the state into one flat buffer and a ``manifest``), ``apply`` (back into the live
tensors, checksums verified), ``tree`` (the JSON skeleton of everything that is not a tensor),
``rng`` (every generator's state), ``dtypes``, ``checksum``, ``stream`` (a rank's data file
straight from its tensors), ``cuda_capture`` (device-to-host on a side stream), ``reshard``
(one rank's state for another world size) and ``validate`` (structural checks of all of it).
"""
