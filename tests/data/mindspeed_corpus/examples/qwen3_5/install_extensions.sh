pip install transformers==5.2.0
pip install triton-ascend==3.2.0
